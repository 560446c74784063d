"""Host runtime below the kernels: launches, launch plans, whole-call replay, PDL, interpreter fixes, device queries."""
