"""Linear methods for quantized checkpoints: each creates the parameters a published format
stores, and repacks them after loading into a form heron's kernels read."""
