"""Attention and normalisation ops behind one seam: HIP (csrc) | Triton | torch, chosen per call."""
