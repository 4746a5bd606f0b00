"""Fake of MindIO TTP (``mindio_ttp``, shipped inside MindCluster): see framework_ttp."""
