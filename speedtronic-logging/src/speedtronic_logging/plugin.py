"""Hook implementations registering the W&B and TensorBoard sinks."""
