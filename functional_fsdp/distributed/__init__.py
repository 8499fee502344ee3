"""The distributed layer, the only caller of ``torch.distributed`` (c10d), bottom to top:

``axes`` (reading a mesh by axis name), ``process`` (rank, barrier, object broadcast),
``simulate`` (N ranks in one process), ``accounting`` (``count_comms``), ``failures``
(``CollectiveError``), ``checks`` (the debug mode), ``collectives`` (the differentiable
collectives), ``mesh`` (``init_distributed``, ``make_mesh``).
"""
