module github.com/govirtiofsd/govirtiofsd

go 1.26.8

require (
	github.com/hanwen/go-fuse/v2 v2.12.1
	github.com/seccomp/libseccomp-golang v0.11.1
	github.com/spf13/cobra v1.10.2
	github.com/spf13/pflag v1.0.9
	golang.org/x/sys v0.50.0
)

require github.com/inconshreveable/mousetrap v1.1.0 // indirect
