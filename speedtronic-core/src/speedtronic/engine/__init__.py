"""The training engine: a run's parts (:mod:`~speedtronic.engine.parts`), the loop
(:mod:`~speedtronic.engine.trainer` with its step and state), the composition root
(:mod:`~speedtronic.engine.runtime`), precision, compilation, stopping, held-out evaluation and
the checks made before anything is built."""

__all__: list[str] = []
