"""The transport: shared-memory rings carrying tensors between processes.

    coordinator                                   worker for core k
      Ring.create() --- name ---------------->    Ring.attach(name)
      send(args)  ==== request ring ==========>   recv()
      recv()      <=== response ring =========    send(result)

``ring.Ring`` is a single-producer single-consumer ring of tensor frames on one
shared-memory segment (``neuronmp.shm.segment``), ``codec`` turns tensors into
frames and back, ``_frames`` (C) encodes, decodes and copies them.  The package
itself imports nothing: ``ring`` and ``codec`` load torch when imported.
"""
