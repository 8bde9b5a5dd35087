"""Triton kernels of the MoE block (imported only where triton is installed).

- `routing.py`: top-k routing, one program per token.
- `align.py`: slots sorted by expert and padded to row blocks, one launch at decode sizes.
- `experts.py`: grouped GEMMs over tokens sorted by expert: gate/up with gelu-tanh gating, then down times the
  routing weight.
"""
