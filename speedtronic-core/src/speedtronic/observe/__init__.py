"""What a run shows about itself: metrics and their sinks, FLOPs and MFU, profiling, plots,
thread and CPU-load checks, and the step-time estimate."""

__all__: list[str] = []
