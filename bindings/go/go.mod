module dpar.dev/go

go 1.19
