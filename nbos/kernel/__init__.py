"""nbos.kernel"""
