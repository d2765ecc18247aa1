"""nbos.scaling"""
