"""Training: chat data, self-distillation, target features, losses and the accelerate loop."""
