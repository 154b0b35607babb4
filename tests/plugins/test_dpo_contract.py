"""The DPO fields' rules, in the one contract validate and the trainer both call."""

from finetune_contract.fields import DEMO_DATASET, DEMO_PREFERENCES
from finetune_contract.rules import config_problems
from finetune_contract.train_config import TrainConfig


def problems(**fields):
    return config_problems(TrainConfig(**fields), world_size=2, local_world_size=2, shape=None)


def test_packing_with_dpo_is_refused_naming_both_fields():
    found = problems(method="dpo", packing=True)
    assert [f for f, _ in found] == ["packing"]
    assert "method = dpo" in found[0][1]


def test_dpo_options_on_an_sft_run_are_refused_naming_method():
    found = dict(problems(dpo_loss="ipo", dpo_reference="precompute"))
    assert "method dpo only" in found["dpo_loss"] and "method dpo only" in found["dpo_reference"]


def test_label_smoothing_with_ipo_and_same_response_columns_are_refused():
    found = dict(problems(method="dpo", dpo_loss="ipo", dpo_label_smoothing=0.1,
                          rejected_field="chosen"))
    assert "dpo_loss is ipo" in found["dpo_label_smoothing"]
    assert "also chosen_field" in found["rejected_field"]


def test_text_field_and_tensor_parallel_with_dpo_are_refused():
    found = dict(problems(method="dpo", text_field="text", tp_degree=2))
    assert "text_field" in found and "tp_degree" in found


def test_the_demo_data_set_follows_the_method():
    assert TrainConfig(method="dpo").dataset == DEMO_PREFERENCES
    assert TrainConfig().dataset == DEMO_DATASET
    assert TrainConfig(method="dpo", dataset="mine.jsonl").dataset == "mine.jsonl"
