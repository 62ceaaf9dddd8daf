"""What goes to disk: the memory file and the archive's log of blocks."""
