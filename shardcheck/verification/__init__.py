"""verify: static checks, onnxruntime runs and their findings."""
