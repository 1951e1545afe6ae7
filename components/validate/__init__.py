"""The validate stage: prove a trained model and its checkpoint are sound before evaluating them."""
