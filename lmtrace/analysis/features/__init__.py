"""Features from an archive and a model: the activations an SAE is trained on (archived vectors or a
replay of a run's sequences), a TopK SAE trainer, and the metrics of an SAE on held-out sequences."""
