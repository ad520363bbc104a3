package fuse

import (
	"strconv"
	"syscall"

	"github.com/govirtiofsd/govirtiofsd/internal/bufvec"
)

// FUSE opcodes (include/uapi/linux/fuse.h). go-fuse keeps its own
// unexported, so the daemon defines them.
const (
	OpLookup        = 1
	OpForget        = 2
	OpGetattr       = 3
	OpSetattr       = 4
	OpReadlink      = 5
	OpSymlink       = 6
	OpMknod         = 8
	OpMkdir         = 9
	OpUnlink        = 10
	OpRmdir         = 11
	OpRename        = 12
	OpLink          = 13
	OpOpen          = 14
	OpRead          = 15
	OpWrite         = 16
	OpStatfs        = 17
	OpRelease       = 18
	OpFsync         = 20
	OpSetxattr      = 21
	OpGetxattr      = 22
	OpListxattr     = 23
	OpRemovexattr   = 24
	OpFlush         = 25
	OpInit          = 26
	OpOpendir       = 27
	OpReaddir       = 28
	OpReleasedir    = 29
	OpFsyncdir      = 30
	OpGetlk         = 31
	OpSetlk         = 32
	OpSetlkw        = 33
	OpAccess        = 34
	OpCreate        = 35
	OpInterrupt     = 36
	OpBmap          = 37
	OpDestroy       = 38
	OpIoctl         = 39
	OpPoll          = 40
	OpNotifyReply   = 41
	OpBatchForget   = 42
	OpFallocate     = 43
	OpReaddirplus   = 44
	OpRename2       = 45
	OpLseek         = 46
	OpCopyFileRange = 47
	OpSetupMapping  = 48
	OpRemoveMapping = 49
	OpSyncfs        = 50
	OpTmpfile       = 51
	OpStatx         = 52
	// COPY_FILE_RANGE_64 (7.45): COPY_FILE_RANGE's arguments, the reply
	// a u64 byte count, so that one request may copy 4 GiB or more.
	OpCopyFileRange64 = 53
)

// Sizes of the argument structs after fuse_in_header, as the kernel sends
// them to a client of minor >= 27.
const (
	forgetInSize    = 8
	getattrInSize   = 16
	setattrInSize   = 88
	mknodInSize     = 16
	mkdirInSize     = 8
	renameInSize    = 8  // fuse_rename_in (RENAME)
	rename2InSize   = 16 // fuse_rename2_in (RENAME2)
	linkInSize      = 8
	openInSize      = 8
	createInSize    = 16
	readInSize      = 40
	writeInSize     = 40
	releaseInSize   = 24
	fsyncInSize     = 16
	flushInSize     = 24
	setxattrInSize  = 8  // without FUSE_SETXATTR_EXT
	setxattrExtSize = 16 // with FUSE_SETXATTR_EXT
	getxattrInSize  = 8
	lkInSize        = 48
	accessInSize    = 8
	fallocInSize    = 32
	lseekInSize     = 24
	copyInSize      = 56
	statxInSize     = 24
	initInSize      = 64 // from 7.36; older clients send 16
	initInOldSize   = 16
	batchForgetSize = 8
	forgetOneSize   = 16
)

// Sizes of the reply payloads.
const (
	entryOutSize    = 128
	attrOutSize     = 104
	openOutSize     = 16
	createOutSize   = entryOutSize + openOutSize
	statfsOutSize   = 80
	writeOutSize    = 8
	getxattrOutSize = 8
	lkOutSize       = 24
	lseekOutSize    = 8
	statxOutSize    = 288
	copyOut64Size   = 8
	initOutSize     = 64
)

// opcode is everything the server knows of one FUSE opcode. For every
// opcode alike, decode checks the request (its length, its extensions, a
// session), reads the in bytes of fixed arguments into q.req and the names
// into q.name and q.name2, checks that the reply room holds out bytes and
// zeroes them; serve is left with what is particular to the opcode: the
// file system call and, for a reply of no fixed size, the reply.
type opcode struct {
	name string
	// in is the size of the fixed arguments after fuse_in_header: a
	// request shorter than that is EINVAL, and q.req reads as zero past
	// them. inFor, when set, gives the size per request for a struct that
	// grew in a later protocol (in is then the older, shorter size).
	in    uint8
	inFor func(q *Queue, in *bufvec.Vec) int
	names nameLayout
	// out is the size of a fixed reply payload, which the reply room must
	// hold before the file system is called (so that an operation whose
	// answer cannot be delivered, one taking a lookup reference say, is
	// not carried out); 0 for none, or a size only serve knows.
	out   uint16
	flags opFlags
	// serve is nil for an opcode the server does not implement (ENOSYS,
	// or nothing for a silent one).
	serve func(q *Queue, in, out *bufvec.Vec) syscall.Errno
}

// nameLayout is what follows an opcode's fixed arguments.
type nameLayout uint8

const (
	noNames   nameLayout = iota // nothing the server decodes
	oneName                     // a NUL-terminated name fills the rest
	maybeName                   // oneName, or nothing at all
	twoNames                    // two NUL-terminated names fill the rest
	nameValue                   // a NUL-terminated name, then a value (any bytes)
)

type opFlags uint8

const (
	// silent: the guest waits for no answer, and gets none whatever
	// happens.
	silent opFlags = 1 << iota
	// startsSession: served without a session, which it starts.
	startsSession
	// givesNode: a successful reply hands the guest a node id, the
	// fuse_entry_out the payload starts with.
	givesNode
	// storageBound: the cost is the host's storage whatever the size, so
	// replies already pushed are not held back behind it (Classify's
	// slow).
	storageBound
	// readsFile, writesFile: moves file data into the guest's memory, or
	// out of it: worth a second core when large (Classify's heavy), and
	// counted by the metrics.
	readsFile
	writesFile
	// needsWindow: ENOSYS unless the session has a DAX window.
	needsWindow
)

// numOps is one past the highest opcode the table knows.
const numOps = OpCopyFileRange64 + 1

// opcodes is indexed by opcode. Entry 0, which no opcode uses, stands for
// the unknown ones.
var opcodes = [numOps]opcode{
	OpLookup:   {name: "LOOKUP", names: oneName, out: entryOutSize, flags: givesNode, serve: (*Queue).doLookup},
	OpForget:   {name: "FORGET", in: forgetInSize, flags: silent, serve: (*Queue).doForget},
	OpGetattr:  {name: "GETATTR", in: getattrInSize, out: attrOutSize, serve: (*Queue).doGetattr},
	OpSetattr:  {name: "SETATTR", in: setattrInSize, out: attrOutSize, serve: (*Queue).doSetattr},
	OpReadlink: {name: "READLINK", serve: (*Queue).doReadlink},
	// SYMLINK: the new entry's name, then the link's target.
	OpSymlink: {name: "SYMLINK", names: twoNames, out: entryOutSize, flags: givesNode, serve: (*Queue).doSymlink},
	OpMknod:   {name: "MKNOD", in: mknodInSize, names: oneName, out: entryOutSize, flags: givesNode, serve: (*Queue).doMknod},
	OpMkdir:   {name: "MKDIR", in: mkdirInSize, names: oneName, out: entryOutSize, flags: givesNode, serve: (*Queue).doMkdir},
	OpUnlink:  {name: "UNLINK", names: oneName, serve: (*Queue).doUnlink},
	OpRmdir:   {name: "RMDIR", names: oneName, serve: (*Queue).doRmdir},
	// RENAME sends fuse_rename_in, RENAME2 the longer fuse_rename2_in:
	// read as zero, RENAME's flags are 0.
	OpRename:  {name: "RENAME", in: renameInSize, names: twoNames, serve: (*Queue).doRename},
	OpRename2: {name: "RENAME2", in: rename2InSize, names: twoNames, serve: (*Queue).doRename},
	OpLink:    {name: "LINK", in: linkInSize, names: oneName, out: entryOutSize, flags: givesNode, serve: (*Queue).doLink},
	OpOpen:    {name: "OPEN", in: openInSize, out: openOutSize, serve: (*Queue).doOpen},
	OpRead:    {name: "READ", in: readInSize, flags: readsFile, serve: (*Queue).doRead},
	OpWrite:   {name: "WRITE", in: writeInSize, out: writeOutSize, flags: writesFile, serve: (*Queue).doWrite},
	OpStatfs:  {name: "STATFS", out: statfsOutSize, serve: (*Queue).doStatfs},
	OpRelease: {name: "RELEASE", in: releaseInSize, serve: (*Queue).doRelease},
	OpFsync:   {name: "FSYNC", in: fsyncInSize, flags: storageBound, serve: (*Queue).doFsync},
	// SETXATTR: the name, then the value, which may hold NULs.
	OpSetxattr:    {name: "SETXATTR", in: setxattrInSize, inFor: setxattrIn, names: nameValue, serve: (*Queue).doSetxattr},
	OpGetxattr:    {name: "GETXATTR", in: getxattrInSize, names: oneName, serve: (*Queue).doGetxattr},
	OpListxattr:   {name: "LISTXATTR", in: getxattrInSize, serve: (*Queue).doGetxattr},
	OpRemovexattr: {name: "REMOVEXATTR", names: oneName, serve: (*Queue).doRemovexattr},
	OpFlush:       {name: "FLUSH", in: flushInSize, flags: storageBound, serve: (*Queue).doFlush},
	OpInit:        {name: "INIT", in: initInOldSize, inFor: initIn, out: initOutSize, flags: startsSession, serve: (*Queue).doInit},
	OpOpendir:     {name: "OPENDIR", in: openInSize, out: openOutSize, serve: (*Queue).doOpendir},
	OpReaddir:     {name: "READDIR", in: readInSize, serve: (*Queue).doReaddir},
	OpReleasedir:  {name: "RELEASEDIR", in: releaseInSize, serve: (*Queue).doReleasedir},
	OpFsyncdir:    {name: "FSYNCDIR", in: fsyncInSize, flags: storageBound, serve: (*Queue).doFsyncdir},
	OpGetlk:       {name: "GETLK", in: lkInSize, out: lkOutSize, serve: (*Queue).doGetlk},
	OpSetlk:       {name: "SETLK", in: lkInSize, serve: (*Queue).doSetlk},
	OpSetlkw:      {name: "SETLKW", in: lkInSize, serve: (*Queue).doSetlk},
	OpAccess:      {name: "ACCESS", in: accessInSize, serve: (*Queue).doAccess},
	OpCreate:      {name: "CREATE", in: createInSize, names: oneName, out: createOutSize, flags: givesNode, serve: (*Queue).doCreate},
	// The guest never waits for an INTERRUPT's answer.
	OpInterrupt: {name: "INTERRUPT", flags: silent},
	OpBmap:      {name: "BMAP"},
	OpDestroy:   {name: "DESTROY", serve: (*Queue).doDestroy},
	// IOCTL, POLL: ENOSYS.
	OpIoctl: {name: "IOCTL"},
	OpPoll:  {name: "POLL"},
	// The server sends no notification to be replied to.
	OpNotifyReply: {name: "NOTIFY_REPLY", flags: silent},
	// BATCH_FORGET: fuse_batch_forget_in, then count fuse_forget_one.
	OpBatchForget:   {name: "BATCH_FORGET", in: batchForgetSize, flags: silent, serve: (*Queue).doBatchForget},
	OpFallocate:     {name: "FALLOCATE", in: fallocInSize, flags: storageBound, serve: (*Queue).doFallocate},
	OpReaddirplus:   {name: "READDIRPLUS", in: readInSize, serve: (*Queue).doReaddir},
	OpLseek:         {name: "LSEEK", in: lseekInSize, out: lseekOutSize, serve: (*Queue).doLseek},
	OpCopyFileRange: {name: "COPY_FILE_RANGE", in: copyInSize, out: writeOutSize, flags: storageBound, serve: (*Queue).doCopyFileRange},
	// DAX (dax.go): ENOSYS without a window. A mapping waits for the
	// VMM's answer: slow. REMOVEMAPPING: fuse_removemapping_in, then count
	// fuse_removemapping_one.
	OpSetupMapping:  {name: "SETUPMAPPING", in: setupMappingInSize, flags: needsWindow | storageBound, serve: (*Queue).doSetupMapping},
	OpRemoveMapping: {name: "REMOVEMAPPING", in: removeMappingInSize, flags: needsWindow | storageBound, serve: (*Queue).doRemoveMapping},
	// SYNCFS: fuse_syncfs_in is 8 bytes of padding, which serve skips
	// without reading.
	OpSyncfs: {name: "SYNCFS", flags: storageBound, serve: (*Queue).doSyncfs},
	// TMPFILE: the name of the kernel's placeholder dentry ("/") means
	// nothing to the file system, and may be absent.
	OpTmpfile: {name: "TMPFILE", in: createInSize, names: maybeName, out: createOutSize, flags: givesNode, serve: (*Queue).doTmpfile},
	OpStatx:   {name: "STATX", in: statxInSize, out: statxOutSize, serve: (*Queue).doStatx},
	// Linux sends COPY_FILE_RANGE_64 whatever minor INIT answered, and
	// falls back to COPY_FILE_RANGE for good after an ENOSYS.
	OpCopyFileRange64: {name: "COPY_FILE_RANGE_64", in: copyInSize, out: copyOut64Size, flags: storageBound, serve: (*Queue).doCopyFileRange64},
}

// lookup returns op's entry, entry 0 for an unknown op.
func lookup(op uint32) *opcode {
	if op < uint32(len(opcodes)) {
		return &opcodes[op]
	}
	return &opcodes[0]
}

// OpName returns the opcode's name, or its number for unknown opcodes.
func OpName(op uint32) string {
	if name := lookup(op).name; name != "" {
		return name
	}
	return "OP" + strconv.FormatUint(uint64(op), 10)
}
