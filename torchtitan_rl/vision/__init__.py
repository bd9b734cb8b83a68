"""Images in prompts: the vision model's preprocessing (preprocess.py), without torchvision."""
