"""The training engine shared by the train stage, optimize's fine-tune and `python -m benchmarks train`.

engine.py        optimizer parameter groups, the one-cycle LR schedule, the loss (committee members,
                 label smoothing, logit adjustment, distillation from a teacher) and one training step
distributed.py   devices, bf16 autocast, processes (spawn / torchrun), DDP and FSDP2 wrapping
checkpoint.py    torch.distributed.checkpoint folders: sealed, verified, resumed
"""
