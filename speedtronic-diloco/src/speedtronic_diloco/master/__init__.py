"""The DumbDiLoCo master, room by room: :mod:`~speedtronic_diloco.master.loop` (the thread
and the order of things), :mod:`~speedtronic_diloco.master.intake`,
:mod:`~speedtronic_diloco.master.round`, :mod:`~speedtronic_diloco.master.publish`,
:mod:`~speedtronic_diloco.master.report`, :mod:`~speedtronic_diloco.master.history` and
:mod:`~speedtronic_diloco.master.state`."""
