"""Libraries of the optimize stage (pipeline/stages/optimize.py): pruning, fine-tuning with distillation,
int8 quantization, ONNX export, and making + judging the candidate variants."""
