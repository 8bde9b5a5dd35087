"""Model definitions: Gemma 4 text (gemma4.py; its decoder layer in gemma4_layers.py); vision and the MTP
assistant come later."""
