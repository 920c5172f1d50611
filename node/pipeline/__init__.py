"""Pipeline execution: a model's units cut into contiguous stages, each run by one node.

``schedule`` orders a stage's forwards and backwards (GPipe, 1F1B); ``stage`` runs one stage's
share of a step and steps its parameters; ``transport`` is how stages' tensors meet (in memory
here; through the hub's relay in ``relay``; straight from stage to stage in ``direct``, whose
``RoutedTransport`` mixes the two), each message sealed and checked the same way (``sealed``);
``local`` runs every stage of a pipeline in threads.
``remote`` computes a piece of one layer on another party through a transport, which ``experts``
(a mixture of experts whose experts live on other parties) and ``tensorsplit`` (Linear and
attention split by width) build on; ``expertrounds`` and ``reroute`` are how the experts' router
routes around a lost host; ``witness`` records a host's calls on the micro-batches its caller
chose, for the referee to re-execute (protocol/piececall.py).
"""
