"""nbos.transport"""
