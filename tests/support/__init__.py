"""What the tests share, imported as `tests.support.<module>` (never copied into a test module,
never imported from another test module):

- `system`: what the tests need from outside the clone, or a skip saying how to get it (a failure
  with FINETUNE_REQUIRE_SYSTEM_DEPS=1, as CI runs): `missing_dependency`, and the Debian
  programs (etcd, prometheus, promtool, chromium).
- `aws`: moto in server mode; fixtures `moto_endpoint`, `aws`, `s3`.
- `etcd`: fixture `etcd_server`, a real etcd.
- `mlflow`: a real `mlflow server` (SQLite; local or S3 artifacts): `start_mlflow`, fixture
  `mlflow_server`.
- `kube`: kmock's Kubernetes emulator fixed where the eks target relies on the API server,
  served from its own thread (`Cluster`); fixture `cluster`; the test playing the training
  operator (`TrainingOperator`, `create_job`, `set_condition`).
- `eks`: an eks run config (`eks_config`), the eks target with short timeouts, the node
  group's Auto Scaling group moto does not make (`the_nodegroups_asg`); fixtures `nodegroup`,
  `task_log`.
- `deferral`: driving deferrable operators and triggers as Airflow does.
- `airflow`: a real Airflow (api-server, scheduler, dag-processor, triggerer as separate
  processes, each killed and started again on its own, `Airflow`) and a REST client (`Api`),
  both from tools.airflow_components (the docs' screenshots start the same one), and a bounded
  wait (`wait_for`) that fails the test with the components' logs. Airflow's UI in headless
  Chromium is tools.airflow_ui.
- `schemas`: manifests checked against the Kubernetes, PyTorchJob and Kubeflow Trainer v2 CRD
  schemas (the CRDs from $FINETUNE_K8S_SCHEMAS or ../shared/k8s-schemas).
- `trainer`: the test playing Kubeflow Trainer v2 and JobSet for a TrainJob
  (`TrainerController`, `trainjob_config`, `set_trainjob_status`).
- `preflight`: what the preflight program measures, made to order (`measured`).
- `training`: torchrun, demo rows and metrics files for the trainer tests, the ranks of
  torchrun's workers (`torchrun_workers`); fixture `world_of_one`.
- `chat_tokenizers`: tokenizers the tests make with the chat templates of three families (the
  demo's, Qwen-style with generation marks, Llama 3-style without), and the demo tokenizer
  without its template.

Fixtures reach the tests through conftest.py files: tests/conftest.py lists the light modules in
`pytest_plugins`; the folders that need the heavy ones (Airflow, kmock) import their fixtures.
A free loopback port is `finetune.etcd.free_port`, the one the local target uses.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
