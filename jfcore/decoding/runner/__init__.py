"""The model side of decoding: the model runner, the batch's KV cache slots and the forward over them, fixed-shape
(compiled, CUDA-graph) forwards, shared prompt prefixes, the CPU linear kernels and the output head."""
