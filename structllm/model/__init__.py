"""Model definitions and loading. Importing this package does not import torch."""
