"""onnxruntime and its runs: sessions, feeds, dims, the memory estimate."""
