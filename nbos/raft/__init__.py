"""nbos.raft"""
