from .loss_weights import compute_loss_weights
