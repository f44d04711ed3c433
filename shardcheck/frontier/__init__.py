"""Where to cut: the tensors CP scatters and gathers (the frontier), found by ``search``.

* ``masks``: the seeds, each layer's Q, K and V and the masks each rank needs its rows of;
* ``region``: the walk back from the seeds through position-wise ops, stopping at the cuts;
* ``whole``: what a round's region forces to be whole on every rank (``sources``: what a Shape
  sizes); the rounds walk back again, the cuts moving forward, until nothing new must be;
* ``gathers``: the walk forward from the layers' outputs to the tensors to gather;
* ``exactness``: the places where no cut makes CP exact, as warnings;
* ``result``: the cut tensors in graph order. ``tensor_ids`` and ``sliced`` serve the walks
  over the whole graph (tensors as integers; whether a tensor is a slice).
"""
