"""FSDP2 fine-tuning of Llama-class causal LMs, run by torchrun; see trainer/train.py."""
