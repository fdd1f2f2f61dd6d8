"""A DumbDiLoCo node, room by room: :mod:`~speedtronic_diloco.node.boundary` (when to sync and
the pseudo-gradient), :mod:`~speedtronic_diloco.node.lanes` (the upload and poll threads),
:mod:`~speedtronic_diloco.node.install` (fetching and installing a global),
:mod:`~speedtronic_diloco.node.resume` (a pending upload after a restart) and
:mod:`~speedtronic_diloco.node.state` (the node's state and its one codec), sharing a
:class:`~speedtronic_diloco.node.context.NodeContext`. The coordinator
(:mod:`speedtronic_diloco.coordinator`) calls them in order; they return decisions
(:mod:`~speedtronic_diloco.node.decisions`) that it applies under the node's lock."""
