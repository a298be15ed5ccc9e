"""Every CUDA graph of the package: the whole training iteration (`full_iteration`) and the frozen trunk of
MTP-only training (`frozen_trunk`, through `graphed_forward`)."""
