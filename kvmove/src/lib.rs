//! kvmove: the transfer engine with its backend chosen by configuration.
