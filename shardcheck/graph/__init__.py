"""Reading ONNX: the protobuf classes, the model loader and its checks, the graph index."""
