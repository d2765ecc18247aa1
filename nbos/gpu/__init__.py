"""nbos.gpu"""
