"""Node processes on this machine: ``--local-nodes N`` (``nodes``), the pre-imported launcher they are
forked from (``launcher``), and cgroup v1 groups for unequal nodes in benches and tests (``cgroups``)."""
