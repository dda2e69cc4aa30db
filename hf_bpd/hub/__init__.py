"""Where models come from and go to: base-model loading (`base_models`), checkpoint files (`checkpoints`) and model
cards (`model_card`)."""
