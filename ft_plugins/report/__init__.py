"""``ft-plugins report``: a job's goodput and each fault's cost, from the events its processes wrote
(:mod:`ft_plugins.events`): :mod:`.reading` reads them into one job on one clock, :mod:`.goodput` labels its time,
:mod:`.table` writes the table, :mod:`.plot` draws the timeline (matplotlib, the ``report`` extra)."""
