"""The one error every connector raises: a warehouse problem told in words a user can act on
(which connection, which table or column, what to change), never a driver's stack trace or a secret."""


class WarehouseError(ValueError):
    pass
