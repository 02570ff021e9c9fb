"""gateway/dns"""
