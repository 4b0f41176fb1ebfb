"""Training: conversation data, regeneration by the target, draft vocabulary, EAGLE-1/3 and Medusa
trainers on one loop (torchrun DDP), export. See ``docs``-level overview in README "Training"."""
