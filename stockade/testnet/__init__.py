"""stockade/testnet"""
