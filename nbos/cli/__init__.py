"""nbos.cli"""
