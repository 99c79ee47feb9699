"""torch.library custom ops: each fused op's autograd formula and fake (meta) kernel."""
