"""Training data: sources, chat rendering, the dataset and its order, regeneration, shipped files."""
