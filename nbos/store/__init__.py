"""nbos.store"""
