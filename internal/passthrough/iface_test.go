package passthrough_test

import (
	"github.com/govirtiofsd/govirtiofsd/internal/fuse"
	"github.com/govirtiofsd/govirtiofsd/internal/passthrough"
)

// FS satisfies the server's interface without importing internal/fuse.
var _ fuse.FileSystem = (*passthrough.FS)(nil)

// FS migrates.
var _ fuse.MigratableFileSystem = (*passthrough.FS)(nil)

// FS offers the server its DAX window.
var _ fuse.Windowed = (*passthrough.FS)(nil)
