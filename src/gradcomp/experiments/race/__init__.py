"""`gradcomp race`: time to accuracy on an emulated slow network (race), the methods it runs (method), its worker
process (race_worker), the network namespaces and shaped links (netns), torch's own DDP baselines (torch_baselines)."""
