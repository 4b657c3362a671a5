"""One worker process per reserved NeuronCore, and the coordinator feeding them.

A ``coordinator.Pool`` is owned by the session of a runtime
(``neuronmp.session.session``), which starts it on the first model load and
closes it when the runtime shuts down.  The layers above import each name from
the module that defines it:

    coordinator.Pool                       the executor
    answer.Answer, Destination, Joint,     the answer type and what fills it;
      gather, wake, Pending                a blocking call's answer
    pacing.wakes_deferred,                 device-time pacing hints
      answers_read_ahead
    loopchannel.LoopAnswer, Timer,         a core owned by an event loop
      channel_for
    stats.StatsBlock, read_all ...         per-core counters, torch-free (monitors
                                           import it alone)

The package itself imports nothing, so ``neuronmp.pool.stats`` loads no torch.
"""
