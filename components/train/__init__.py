"""The train stage: TorchX-launched pretraining, one capability per module."""
