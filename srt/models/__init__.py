"""Model definitions: Gemma 4 text (gemma4.py); vision and the MTP assistant come later."""
