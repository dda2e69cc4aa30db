"""Library code for training: instruction data (`data`), cached base hidden states and the heads' trainer
(`hidden_states`), LoRA for Medusa-2 (`lora`). The `accelerate launch`-able scripts in the repository's
`training/` folder are thin wrappers over this package."""
